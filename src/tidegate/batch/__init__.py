"""The OpenAI Batch API's pure half: uploads parsed and checked, batch records and their states,
result lines. The live half (Redis, the HTTP routes, the worker) is in `tidegate.gateway.batch_*`."""
