"""`tidegate chaos`: fault injection against a running deployment, with a report. A tool: it may import
any part of tidegate, and nothing but the CLI imports it.

  faults          the fault proxy's fault set (one document for YAML, admin JSON and flags)
  fault_proxy     asyncio TCP proxy with run-time faults; proxy_admin: its HTTP switch and client
  process_faults  kill, pause, restart, CPU and memory pressure, Kubernetes pod deletion
  partition       network partitions with network namespaces (root only)
  experiment      the YAML experiment; runner: load + timeline + gateway samples; report: tables + JSON
"""
