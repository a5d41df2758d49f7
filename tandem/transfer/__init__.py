"""Transfer layer shared by encoder and language: block buffers, Mooncake engine, Attach."""
