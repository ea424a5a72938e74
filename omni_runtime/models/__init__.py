"""Model resolution: local directories and the offline-built ``builtin:`` models."""
