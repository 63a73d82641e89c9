"""The layout of a model over devices, one concept: `layout` is its one type (the mesh's sizes,
how the data-parallel ranks hold the model; built once, read by all), `parallelize` decides it
(DDP, FSDP, TP, PP), `fsdp` (with the `Strategy` that holds the layout and why),
`tensor_parallel` (with `tp_styles`, `heads`) and `pipeline_parallel` (with `pipeline_split`,
`blocks`) apply it, `ties` keeps tied parameters tied; `auto` measures what `tp: auto` weighs and
`forward_checks` tries a layout before launch, both on `fake`'s process groups; `devices` and
`groups` are the devices and process groups below; `ft` joins replica groups across the run
(torchft: quorum, the cross-group reduce, commit and heal; `fault_tolerance:`)."""
