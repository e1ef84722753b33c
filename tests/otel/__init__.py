"""The OpenTelemetry hook (``mos_lease.otel``): needs the ``otel`` extra and the SDK."""
