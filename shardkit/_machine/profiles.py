"""The Hypothesis settings profiles shardkit registers, and how a run reads them.

Registered when ``shardkit`` is imported and when pytest loads the shardkit plugin,
so ``pytest --hypothesis-profile shardkit-ci`` works with no conftest. A machine's
``TestCase`` runs under ``shardkit-ci`` unless the user picks a profile
(``--hypothesis-profile``); whatever the profile, the settings that would let the
wall clock decide a result (``deadline``, the ``too_slow`` health check) are off.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from hypothesis import HealthCheck, Phase, settings

__all__ = [
    "CI_PROFILE",
    "DEFAULT_EXAMPLES",
    "DEFAULT_PROFILE",
    "DEFAULT_STEPS",
    "KEPT_HEALTH_CHECKS",
    "PROFILES",
    "register_profiles",
    "time_independent",
]

CI_PROFILE = "shardkit-ci"
#: The profile a machine's TestCase runs under when the user chose none.
DEFAULT_PROFILE = CI_PROFILE

#: The size of a run when none is asked for: ``shardkit fuzz``, ``fuzz()``, ``shardkit bench``
#: and a TestCase under the ``shardkit-ci`` profile all read it from here.
DEFAULT_EXAMPLES = 200
DEFAULT_STEPS = 50

#: name → (examples, steps per example, derandomized)
PROFILES: Mapping[str, tuple[int, int, bool]] = MappingProxyType({
    "shardkit-ci": (DEFAULT_EXAMPLES, DEFAULT_STEPS, True),
    "shardkit-dev": (50, 30, False),
    "shardkit-nightly": (5000, 100, False),
})


#: Health checks kept on: HypoFuzz refuses to fuzz a test whose settings suppress
#: ``nested_given``, and no shardkit machine nests ``@given`` (older Hypothesis has no such check).
KEPT_HEALTH_CHECKS = frozenset(check for check in HealthCheck if check.name == "nested_given")


def time_independent(base: settings) -> settings:
    """``base`` with everything that reads the wall clock or rejects a long example turned off:
    no deadline, and no health check (``too_slow`` times the engine; the size checks refuse
    the long examples ``--steps`` asks for; the rest concern hand-written ``@given`` tests;
    ``nested_given`` stays, see ``KEPT_HEALTH_CHECKS``).
    The explain phase is dropped too: it runs variants after shrinking, and the failure
    reported must be the one the shrinker ended on."""
    return settings(
        base,
        deadline=None,
        phases=[phase for phase in base.phases if phase is not Phase.explain],
        suppress_health_check=[check for check in HealthCheck if check not in KEPT_HEALTH_CHECKS],
        print_blob=True,
        report_multiple_bugs=False,
    )


def register_profiles() -> None:
    # Built on Hypothesis's "default" profile, not on the one loaded now: on a CI machine
    # (where CI is set) Hypothesis loads its "ci" profile by itself, which has no database,
    # and shardkit-dev and shardkit-nightly would lose theirs (HypoFuzz then cannot start).
    default = settings.get_profile("default")
    for name, (examples, steps, derandomized) in PROFILES.items():
        settings.register_profile(
            name,
            time_independent(
                settings(default, max_examples=examples, stateful_step_count=steps, derandomize=derandomized)
            ),
        )


register_profiles()


def current_profile_name() -> str:
    """The Hypothesis profile loaded now ("default" on Hypothesis versions that cannot say)."""
    name = getattr(settings, "get_current_profile_name", None)
    return str(name()) if callable(name) else "default"


def suite_settings(explicit: settings | None) -> tuple[settings, str]:
    """The settings a machine's ``TestCase`` runs under, and where they come from: its own
    ``settings`` if the user set them, else a profile the user loaded (``--hypothesis-profile``),
    else ``shardkit-ci`` (Hypothesis's own "default", and the "ci" it loads by itself on a CI
    machine, are not a choice the user made)."""
    if explicit is not None:
        return explicit, "the TestCase's own settings"
    name = current_profile_name()
    if name in ("default", "ci"):
        return settings.get_profile(DEFAULT_PROFILE), f"profile {DEFAULT_PROFILE}"
    return settings(), f"profile {name}"
