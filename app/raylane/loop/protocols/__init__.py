"""What the loop agrees on with the rest of the world: the user's `Pipeline` and hooks, a batch's
shapes (`batches`), the `Runtime` a launcher hands the loop, the events rank 0 publishes to the
driver, and the typed result of a run. Interfaces and plain data: no training happens here."""
