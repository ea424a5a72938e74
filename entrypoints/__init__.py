"""User-facing surfaces: ``Omni``, ``AsyncOmni``, the OpenAI-style server and the CLI."""
