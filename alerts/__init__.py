"""Prometheus recording and alerting rules, and the Alertmanager config, rendered from
sidecar.telemetry.thresholds. Run `python -m alerts.build` after changing a threshold."""
