"""How the kit reports a failure: ConformanceError, naming the plugin under test and the rule, and,
for an exception a plugin raised rather than a contract check, which plugin's call it came from.

A bare exception (not a PluginError) carries no plugin name. The kit finds the plugins on its way
in the traceback: the outermost is the one the engine called, the innermost the one that raised.
A ValueError raised by one plugin inside another's call is that caller's input refused (the
contract's reading of a ValueError: a bad input, reported by the plugin given it), so it is put
down to the caller: a scheduler that admits a sequence with K/V the cache does not hold is named,
not the cache that refused it.
"""
from __future__ import annotations

from types import TracebackType

from ablate.api.plugin import Plugin, PluginError


class ConformanceError(AssertionError):
    """A plugin fails the kit: the message names it (`<slot>=<name>`) and the rule it breaks."""


def plugin_calls(tb: TracebackType | None) -> list[tuple[Plugin, str, str]]:
    """(plugin, outermost method, innermost method) for each run of frames of one plugin's methods,
    outermost first."""
    calls: list[tuple[Plugin, str, str]] = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, Plugin):
            method = tb.tb_frame.f_code.co_name
            if calls and calls[-1][0] is owner:
                calls[-1] = (owner, calls[-1][1], method)
            else:
                calls.append((owner, method, method))
        tb = tb.tb_next
    return calls


def where(err: BaseException) -> str:
    """Who raised `err`, in words, with its type and message."""
    calls = plugin_calls(err.__traceback__)
    what = f"{type(err).__name__}: {err}"
    if not calls:
        return what
    raiser, _, raised_in = calls[-1]
    caller, called_as, _ = calls[0]
    if caller is not raiser and isinstance(err, ValueError):
        return (f"{caller}.{called_as} gave {raiser}.{raised_in} an input it refused ({what}): the fault is "
                f"{caller}'s")
    if caller is not raiser:
        return f"{raiser}.{raised_in}, called from {caller}.{called_as}, raised {what}"
    return f"{raiser}.{raised_in} raised {what}"


def failing(plugin: Plugin | str, scenario: str, err: Exception) -> ConformanceError:
    at = f"in the scenario '{scenario}'"
    if isinstance(err, PluginError):
        return ConformanceError(f"{plugin} fails the kit {at}: {err}")
    return ConformanceError(f"{plugin} fails the kit {at}: {where(err)}")
