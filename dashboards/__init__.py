"""Grafana dashboards as code (grafanalib). Sources are `*.dashboard.py`;
`python -m dashboards.build` writes dashboards/generated/*.json, which Grafana provisions."""
