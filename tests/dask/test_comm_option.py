"""``comm`` is not an option (the communicator follows from where tasks run): a stale setting is refused, not ignored."""

from __future__ import annotations

import asyncio

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster

from mpshuffle.dask import shuffle
from mpshuffle.errors import OptionError


def _df() -> dd.DataFrame:
    return dd.from_pandas(pd.DataFrame({"k": np.arange(100), "v": np.arange(100)}), npartitions=4)


def test_comm_in_config_is_refused_with_a_sync_client(client: Client) -> None:
    with dask.config.set({"mpshuffle.comm": "local"}), pytest.raises(
        OptionError, match=r"unknown mpshuffle option\(s\) 'comm'; valid options are: timeout"
    ):
        shuffle(_df(), "k")
    # Nothing was bootstrapped with it: without the setting the shuffle runs.
    assert sorted(shuffle(_df(), "k").compute()["v"].tolist()) == list(range(100))


def test_comm_in_config_is_refused_with_an_async_client_before_any_task() -> None:
    """The graph's options are checked where it is built, not first by the tasks' bootstrap."""

    async def main() -> list[int]:
        async with LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0", asynchronous=True
        ) as cluster, Client(cluster, asynchronous=True) as client:
            with dask.config.set({"mpshuffle.comm": "local"}), pytest.raises(
                OptionError, match=r"unknown mpshuffle option\(s\) 'comm'"
            ):
                shuffle(_df(), "k")
            out = await client.compute(shuffle(_df(), "k"))
            return sorted(out["v"].tolist())

    assert asyncio.run(main()) == list(range(100))
