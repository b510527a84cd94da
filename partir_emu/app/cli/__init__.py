"""The command line: ``partir-emu`` and its subcommands (:mod:`.main` parses and dispatches; one module
per command family: :mod:`.simulate`, :mod:`.des`, :mod:`.fidelity`, :mod:`.mpi_run`), its exit codes
(:mod:`.exits`), the phase timer of ``--verbose`` (:mod:`.phases`) and the fault options (:mod:`.faults`)."""
