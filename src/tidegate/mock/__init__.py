"""A mock OpenAI-compatible upstream (`tidegate mock-upstream`)."""
