"""The layout of a model over devices, one concept: `parallelize` decides it (DDP, FSDP, TP, PP
on one device mesh: `mesh`, `layout`), `fsdp`, `tensor_parallel` (with `tp_styles`, `heads`) and
`pipeline_parallel` (with `pipeline_split`, `blocks`) apply it, `forward_checks` tries it on fake
process groups before launch, `devices` and `groups` are the devices and process groups below."""
