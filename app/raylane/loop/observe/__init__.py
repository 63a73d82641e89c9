"""What is measured and watched while a run trains: step times and stragglers (`steptimes`),
profiles (`profiling`), every node's health (`health`), hung ranks (`hangs`), the start-up's
phases (`startup`), a rank's failure record under torchrun (`rankfailures`), and faults injected
on purpose (`faults`). The Trainer holds these objects; none of them holds the Trainer."""
