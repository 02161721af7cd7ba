"""What every checker test shares: the checkers keep warm groups of ranks (``Ranks.shared``, ``launch(warm=True)``)
across a module's tests; they end with the module, and no rank process may be left behind."""

import pytest

from processes import shared_ranks_end_here


@pytest.fixture(scope="module", autouse=True)
def ranks_end_with_the_module():
    yield from shared_ranks_end_here()
