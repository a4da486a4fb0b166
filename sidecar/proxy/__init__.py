"""The proxy: the request handler, the server edge, path routing, identity, the upstream client
and the background finishers. Imports the base modules, telemetry, metering and billing; never
the core."""
