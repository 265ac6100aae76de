"""The learning core, the same for every driver and free of Kafka and files: the LLM layer,
prompts, playbooks and deltas, the Combee scan, the batch-size policies, the learner, the key
pipeline, the version builder and the publish gate. Import its modules directly."""

__all__: list[str] = []
