"""Where the store lives by default: light enough for the CLI's parser to name it."""
DEFAULT_DB_URL = "sqlite:///kvtune.db"
DB_ENV = "KVTUNE_DB"
