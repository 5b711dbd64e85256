"""ClientShares: one client's sequences held to its share; past it a request waits for the
client's own to finish (in order), a client with too many waiting gets 429, one request over the
share alone 400, and a request whose client leaves while it waits counts nothing."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm.entrypoints.openai.client_share import ClientShares, ShareRefused


def test_past_its_share_a_request_waits_for_the_clients_own_then_runs_in_order():
    async def run():
        shares = ClientShares(0.5, 8, max_waiting_seqs=4)  # 4 sequences per client
        await shares.take("a", 3, "n")
        second = asyncio.ensure_future(shares.take("a", 2, "n"))
        third = asyncio.ensure_future(shares.take("a", 1, "n"))  # fits, but waits its turn
        await asyncio.sleep(0)
        assert not second.done() and not third.done() and shares.waiting("a") == 3
        await shares.take("b", 4, "n")  # another client is not held up by a's
        with pytest.raises(ShareRefused) as err:
            await shares.take("a", 2, "n")  # 3 waiting + 2 > 4
        assert err.value.status == 429 and "--max-waiting" in str(err.value)
        with pytest.raises(ShareRefused) as err:
            await shares.take("a", 5, "prompt")
        assert err.value.status == 400 and err.value.param == "prompt"
        shares.give_back("a", 3)
        await asyncio.sleep(0)
        assert second.done() and third.done() and shares.in_flight("a") == 3
        assert shares.waiting("a") == 0
    asyncio.run(run())


def test_a_request_whose_client_leaves_while_waiting_counts_nothing():
    async def run():
        shares = ClientShares(0.5, 4)  # 2 per client
        await shares.take("a", 2, "n")
        big = asyncio.ensure_future(shares.take("a", 2, "n"))
        small = asyncio.ensure_future(shares.take("a", 1, "n"))
        await asyncio.sleep(0)
        big.cancel()  # the client disconnected
        await asyncio.sleep(0)
        assert big.cancelled() and shares.waiting("a") == 1
        shares.give_back("a", 1)
        await asyncio.sleep(0)
        assert small.done() and shares.in_flight("a") == 2
        shares.give_back("a", 2)
        assert shares.in_flight("a") == 0
    asyncio.run(run())


def test_share_one_is_no_cap():
    async def run():
        shares = ClientShares(1.0, 4)
        await shares.take("a", 100, "n")
        assert shares.max_seqs is None and shares.in_flight("a") == 100
    asyncio.run(run())
