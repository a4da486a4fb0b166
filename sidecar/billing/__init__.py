"""Billing: budgets and their stores (in process, Redis), admission, the ledger and the fleet
ledger, reports and the audit trail. Imports the base modules, telemetry and metering; never the
proxy or the core."""
