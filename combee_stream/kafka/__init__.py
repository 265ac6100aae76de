"""Everything Kafka and nothing about learning: the local broker, topics, producers, the one
topic reader, the subscriber, ingest and dead letters. Import its modules directly."""

__all__: list[str] = []
