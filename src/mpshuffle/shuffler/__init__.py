"""The shuffle engine: one rank's share of a run, for host and device data.

Nothing here imports Dask or distributed: a run is driven by whoever holds a
:class:`~mpshuffle.comm.Communicator` (the Dask integration in
:mod:`mpshuffle.dask`, a test, a benchmark).

Modules
-------
run
    :class:`~mpshuffle.shuffler.run.Run`, the run protocol and the lifecycle
    both kinds share (barrier acknowledgements, owned partitions, fail,
    close), and :class:`~mpshuffle.shuffler.run.Statistics`.
host
    :class:`~mpshuffle.shuffler.host.Shuffler`, one rank's state of a host run.
device
    :class:`~mpshuffle.shuffler.device.DeviceRun`, one rank's state of a
    device run (CuPy/cudf partitions exchanged over NCCL): ``state`` (the
    rank's GPU, budget, NCCL transport and exchange turns), ``buffers``
    (buffers in their memory tiers), ``exchange`` (round sizes, headers,
    consolidation plan), ``run`` (the run).
context
    :class:`~mpshuffle.shuffler.context.WorkerContext`, what one rank of a
    generation holds: communicator, budgets, GPU and runs.

The bulk-synchronous device shuffle that the GPU benchmark measures
:class:`~mpshuffle.shuffler.device.DeviceRun` against is not here: a
baseline lives with its benchmark (``benchmarks/gpu_collective.py``).
"""
