"""The artifact store: content-addressed artifact folders on a local disk or on object storage, build locks and gc."""
