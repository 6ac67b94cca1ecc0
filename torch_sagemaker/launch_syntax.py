"""The syntax of launcher variables' values, and the bounds on what the environment may say.

SLURM describes a step's hosts in a compressed node list (``node[01-04,07]``) and its tasks
per host in a repeat syntax (``2(x3),1``); both are expanded here, within bounds, so that a
typo or a hostile value cannot make the parser allocate gigabytes or recurse without limit.
``launch_env`` reads the variables and uses these. Pure parsing, no torch.
"""

from __future__ import annotations

import re

#: Bound of every count read from the environment (ranks, tasks, hosts).
MAX_COUNT = 2**31 - 1
#: Most hosts a SLURM node list may expand to (a typo like ``node[0-99999999]`` must not
#: allocate gigabytes).
MAX_NODELIST_HOSTS = 1 << 20
#: Longest host name a SLURM node list may expand to: DNS's limit for a whole name. Without
#: it a few kilobytes of prefix or zero padding times a million hosts took gigabytes.
MAX_HOST_NAME = 253

# ASCII digits only: ``\d`` also matches other scripts' digits, which ``int`` would read.
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")


def show(text: str) -> str:
    """``text`` as messages quote it: its ``repr``, cut short (a variable may be 128 KiB)."""
    return repr(text) if len(text) <= 100 else f"{text[:100]!r}... ({len(text)} characters)"


def parse_nodelist(text: str) -> list[str]:
    """Expands a SLURM host list, e.g. ``"node[01-03,07],login1"``, into host names.

    Follows Slurm's hostlist syntax: comma-separated entries; each entry may hold several
    bracketed groups (``rack[1-2]-node[01-02]`` gives the product, left group outermost);
    a group is a comma-separated list of numbers and ``lo-hi`` ranges, zero-padded to the
    width of ``lo`` when ``lo`` is written with leading zeros.

    Args:
        text: The value of ``SLURM_JOB_NODELIST`` or a similar variable.

    Returns:
        The host names in order.

    Raises:
        ValueError: Unbalanced brackets, an empty entry or group, a range with ``lo > hi``,
            more than ``MAX_NODELIST_HOSTS`` hosts or a host name longer than
            ``MAX_HOST_NAME``; the message names the value.
    """
    hosts: list[str] = []
    for entry in _split_top_level(text):
        if not entry:
            raise ValueError(f"{show(text)} has an empty host entry (a stray comma)")
        hosts.extend(_expand_entry(entry, text, MAX_NODELIST_HOSTS - len(hosts)))
    if not hosts:
        raise ValueError(f"{show(text)} lists no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets; checks that brackets balance and never nest."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"{show(text)} nests brackets at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"{show(text)} closes a bracket it never opened at position {i}")
            depth = 0
        elif ch == "," and not depth:
            entries.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"{show(text)} leaves a bracket open")
    entries.append(text[start:].strip())
    return entries


def _expand_entry(entry: str, text: str, room: int) -> list[str]:
    """All hosts of one entry (no top-level comma); at most ``room`` of them.

    Built one bracketed group at a time, the left group outermost, in a loop: an entry of
    thousands of groups meets the host-name bound below instead of Python's recursion limit.
    """
    names, longest, rest = [""], 0, entry
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            literal, values, rest = rest, [""], ""
        else:
            close_at = rest.index("]", open_at)
            literal = rest[:open_at]
            values = _expand_group(rest[open_at + 1 : close_at], text, room // len(names))
            rest = rest[close_at + 1 :]
        if len(names) * len(values) > room:
            raise ValueError(f"{show(text)} expands to more than {MAX_NODELIST_HOSTS} hosts")
        longest += len(literal) + max(len(v) for v in values)
        if longest > MAX_HOST_NAME:
            raise ValueError(
                f"{show(text)} expands to a host name longer than {MAX_HOST_NAME} characters "
                "(DNS's limit); check the variable's value"
            )
        names = [f"{n}{literal}{v}" for n in names for v in values]
    return names


def _expand_group(group: str, text: str, room: int) -> list[str]:
    values: list[str] = []
    for part in group.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(
                f"{show(text)} has {show(part)} inside brackets: expected a number or a range lo-hi"
            )
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        if max(len(lo_text), len(hi_text)) > MAX_HOST_NAME:  # before int(), which refuses 4301
            raise ValueError(
                f"{show(text)} has a number of more than {MAX_HOST_NAME} digits, longer than a "
                "host name may be"
            )
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise ValueError(f"{show(text)} has the range {show(part)} with lo > hi")
        if hi - lo + 1 > room - len(values):
            raise ValueError(f"{show(text)} expands to more than {MAX_NODELIST_HOSTS} hosts")
        width = len(lo_text) if lo_text.startswith("0") else 0
        values.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return values


_TASKS = re.compile(r"^([0-9]+)(?:\(x([0-9]+)\))?$")


def parse_tasks_per_node(text: str) -> list[int]:
    """Expands SLURM's tasks-per-node list, e.g. ``"2(x3),1"`` into ``[2, 2, 2, 1]``.

    Args:
        text: The value of ``SLURM_STEP_TASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``.

    Returns:
        The number of tasks on each host, in the node list's order.

    Raises:
        ValueError: An entry that is not ``n`` or ``n(xk)``, or more than
            ``MAX_NODELIST_HOSTS`` hosts; the message names the value.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if not match or len(part) > 24:
            raise ValueError(f"{show(text)} has {show(part)}: expected a count n or n(xk)")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if repeat < 1 or repeat > MAX_NODELIST_HOSTS - len(counts) or count > MAX_COUNT:
            raise ValueError(f"{show(text)} has {show(part)}: out of range")
        counts.extend([count] * repeat)
    return counts
