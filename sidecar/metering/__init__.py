"""Metering: what a request asks (the wire formats' requests), usage read from bodies and
streams, the meter that turns a finished exchange into metrics and sinks, and prices. Imports the
base modules and telemetry; never billing, the proxy or the core."""
