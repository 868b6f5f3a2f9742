"""tierplan inside vLLM, as a plugin (no fork). vLLM calls `register()` from the `vllm.general_plugins` entry
point in every process it starts (API server, engine core, workers), possibly more than once.

`register()` first wraps vLLM's model loaders (plugin.py), so the rank that loads the model reads the
`TIERPLAN_VLLM_*` settings again, binds the router capture and starts its agent there
(`TIERPLAN_VLLM_ENABLED=0`: the model loads untouched). Then it checks the settings: an unknown or malformed
one stops vLLM's start with one line naming it (logged at ERROR, and the message of the `SettingsError` it
raises; a typo must not run silently on defaults). The wrapper goes in first because vLLM marks its plugins
loaded before it calls them: an engine started again in the same process, after the setting is fixed, never
calls `register()` again, and it still binds. Nothing happens at import; calling it twice changes nothing.
The KV connector (connector.py) and the stat logger (stats.py) are loaded by vLLM through their own
configuration and entry point.
"""

from __future__ import annotations

import os


def register() -> None:
    from tierplan.agent.adapters.vllm.plugin import install, refuse
    from tierplan.agent.adapters.vllm.settings import SettingsError, VllmPluginSettings

    install()
    try:
        VllmPluginSettings.from_env(os.environ)  # refuse a bad setting at once, in every process
    except SettingsError as exc:
        raise refuse(exc) from None
