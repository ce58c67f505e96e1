"""The engine: scheduling (pure), chunking (pure), the torch runner, the async engine, build."""
