"""The command line and the OpenAI-compatible server: flags, limits, protocol, chat templates."""
