"""Persistence: snapshot files and the SQLite index. The only code that knows the file layout."""
