"""The command line: `ember serve | doctor | bench`; the only place that reads env vars."""
