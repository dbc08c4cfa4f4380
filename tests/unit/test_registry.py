"""Methods, rewards and caches share one registry style: a name -> entry table with one lookup error."""
import pytest

from agg_bench.engine.rewards import REWARDS, build_reward, jpeg_size_kb
from agg_bench.errors import ConfigError
from agg_bench.methods.base import METHODS, build_method
from agg_bench.registry import Registry
from baselines.caches import CACHES, make_config


@pytest.mark.parametrize("registry, key, lookup", [
    (METHODS, "method.name", build_method),
    (REWARDS, "reward.name", build_reward),
    (CACHES, "method.cache", make_config),
])
def test_every_plugin_table_is_a_registry_with_one_lookup_error(registry, key, lookup):
    assert isinstance(registry, Registry) and registry.key == key
    names = registry.names()
    assert len(names) >= 2
    with pytest.raises(ConfigError) as err:
        lookup("no-such-plugin")
    assert (err.value.key, err.value.value) == (key, "no-such-plugin")
    assert all(name in err.value.expected for name in names)


def test_lazy_entries_duplicates_and_decorators():
    registry = Registry("thing.name", {"jpeg": "agg_bench.engine.rewards:jpeg_size_kb"})
    assert dict.get(registry, "jpeg") == "agg_bench.engine.rewards:jpeg_size_kb"  # not imported until used
    assert registry.resolve("jpeg") is jpeg_size_kb and dict.get(registry, "jpeg") is jpeg_size_kb

    @registry.register("double")
    def double(x):
        return 2 * x

    assert registry.resolve("double") is double
    registry.register("double", double)  # the same entry again is harmless
    with pytest.raises(ValueError, match="'double' is already registered"):
        registry.register("double", lambda x: x)
    with pytest.raises(ConfigError, match="thing.name"):
        registry.resolve(3)
