"""The planner's estimate cache keys on every source file of slimtune's, so no code change elsewhere
(an engine's, the host optimizer's) can leave an old answer on disk to be read back."""

from pathlib import Path

import pytest

import slimtune
from slimtune.planning import estimate_cache


@pytest.mark.quick
def test_the_key_covers_every_source_file_of_the_package():
    package = Path(slimtune.__file__).parent
    everything = set(package.rglob("*.py")) | set(package.rglob("*.json"))
    keyed = set(estimate_cache.sources())
    assert everything <= keyed, sorted(str(p.relative_to(package)) for p in everything - keyed)[:5]
    assert package / "engines" / "slide" / "engine.py" in keyed
