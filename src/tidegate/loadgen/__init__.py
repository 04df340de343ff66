"""The load generator behind `tidegate bench`.

PURE, shared with the simulator (seeded numpy generators in, no clock, no I/O):
  arrivals (when), trace (Azure LLM trace replay), mix (who, how long), plan (the schedule),
  scenarios (named traffic shapes).
I/O body: http_client (lean keep-alive HTTP/1.1), driver (open / closed loop, /metrics scraping).
Report: records (per request), stats (percentiles, goodput, lag), report (JSON + table), plots.
"""
