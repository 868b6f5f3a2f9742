"""tierplan inside vLLM, as a plugin (no fork). vLLM calls `register()` from the `vllm.general_plugins` entry
point in every process it starts (API server, engine core, workers), possibly more than once.

`register()` checks the `TIERPLAN_VLLM_*` settings (an unknown or malformed one stops vLLM's start with a
message naming it: a typo must not run silently on defaults) and wraps vLLM's model loaders (plugin.py), so
the rank that loads the model reads them again, binds the router capture and starts its agent there
(`TIERPLAN_VLLM_ENABLED=0`: the model loads untouched). Nothing happens at import;
calling it twice changes nothing. The KV connector (connector.py) and the stat logger (stats.py) are loaded
by vLLM through their own configuration and entry point.
"""

from __future__ import annotations

import os


def register() -> None:
    from tierplan.agent.adapters.vllm.plugin import install
    from tierplan.agent.adapters.vllm.settings import VllmPluginSettings

    VllmPluginSettings.from_env(os.environ)  # refuse a bad setting at once, in every process
    install()
