"""What is measured and watched while a run trains: step times and stragglers (`steptimes`),
profiles (`profiling`), the loop's own clock, throughput and memory (`figures`), every node's
health (`health`), hung ranks (`hangs`), the start-up's phases (`startup`), a rank's failure
record under torchrun (`rankfailures`), and faults injected on purpose (`faults`). The Trainer
holds these objects (`observers`); none of them holds the Trainer. Those that watch its loop are
told its moments through one interface (`observer`: a step's start, its batch, its end, an
epoch's end, the loop's start and end)."""
