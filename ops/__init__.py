"""Operations: the local Prefect stack used by `moeflow up`, `make run` and the end-to-end test."""
