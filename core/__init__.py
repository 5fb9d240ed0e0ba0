"""The ground floor: paths and cache folders, the document table, ledgers, progress reporting and log routing.

Nothing here imports anything else of moeflow: every other package may build on it.
"""
