"""The core: the app factory, the wiring of optional parts, the CLI and its subcommands. May
import every other package; nothing imports it."""
