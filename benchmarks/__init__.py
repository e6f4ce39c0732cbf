"""Benchmarks of sqla-proletarian against raw SQL, pgqueuer and procrastinate.

``make bench`` (or ``python -m benchmarks.run``) starts durable PostgreSQL and MariaDB
servers, measures every contender in interleaved rounds and prints one table of medians and
ratios (also written to ``benchmarks/results.md``). They print; nothing gates on a time.
"""
