"""The Alertmanager config: critical pages, warning makes a ticket, info goes nowhere; the per-user
spend alert is inhibited while the global one fires; a sidecar that is down inhibits only its own
instance's alerts (in a fleet, one replica down must not silence the others' pages)."""

from __future__ import annotations

from typing import Any


def config(
    page_url: str = "http://alert-webhook:8080/page",
    ticket_url: str = "http://alert-webhook:8080/ticket",
    group_wait: str = "30s",
    group_interval: str = "5m",
    repeat_interval: str = "4h",
) -> dict[str, Any]:
    return {
        "route": {
            "receiver": "ticket",
            "group_by": ["alertname", "job", "model"],
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": repeat_interval,
            "routes": [
                {"matchers": ['severity="critical"'], "receiver": "page"},
                {"matchers": ['severity="warning"'], "receiver": "ticket"},
                {"matchers": ['severity="info"'], "receiver": "null"},
            ],
        },
        "receivers": [
            {"name": "page", "webhook_configs": [{"url": page_url, "send_resolved": True}]},
            {"name": "ticket", "webhook_configs": [{"url": ticket_url, "send_resolved": True}]},
            {"name": "null"},
        ],
        "inhibit_rules": [
            {
                "source_matchers": ['alertname="LLMDailySpendHigh"'],
                "target_matchers": ['alertname="LLMUserDailySpendHigh"'],
                "equal": ["job"],
            },
            {
                "source_matchers": ['alertname="LLMSidecarDown"'],
                "target_matchers": ['alertname=~"LLM.+"', 'alertname!="LLMSidecarDown"'],
                # an alert summed over the fleet has no instance, so it is never inhibited
                "equal": ["job", "instance"],
            },
        ],
    }
