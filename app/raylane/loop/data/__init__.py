"""A run's data: `loader` (map-style datasets, samplers and the held batch), `streaming` and
`files` (file and object-store sources read in row groups), `baddata` (a bad row or value said in
one line naming the file, the row and the config key it breaks)."""
