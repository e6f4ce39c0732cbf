"""pytest plugin of sqla-proletarian (registered through the ``pytest11`` entry point)."""
