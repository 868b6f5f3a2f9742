"""Grafana dashboards as code (grafana-foundation-sdk): the overview and service dashboards, their export.

Runs in the user's shell (`tierplan dashboards export|push`) and in tests. Builds dashboard JSON only: it must
never start a server or touch the network at import; `push` is the one place that talks to Grafana.
"""
