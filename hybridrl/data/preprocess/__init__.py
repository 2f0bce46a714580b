"""Scripts that turn public datasets into the RL parquet schema (`python -m hybridrl.data.preprocess.<name>`)."""
