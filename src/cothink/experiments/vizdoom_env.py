"""ViZDoom as a text world whose clock is the engine's forward passes.

The game runs headless (window hidden, no sound) in synchronous player mode: nothing happens between
our calls. `DoomWorld.advance(tics)` moves it on with the held action; the experiment calls it once per
engine forward pass (`tics_per_pass` tics, default 1) from a step listener, so a slow agent sees the
world move on while it thinks, and latency is counted in passes, not in this CPU's seconds.

Actions: a scenario's buttons as a small vocabulary of one-token words (`forward`, `left`, `right`, and
in deadly_corridor `shoot`, `back`; its strafe buttons are left out so every choice is one token and
an action probe is one forward pass), plus `idle`.
Actions are *held keys*: the last chosen action stays pressed until the next one (`idle` releases it).
That is how a human plays, and it makes latency cost what it costs in a real game: acting on a stale
observation (an over-shot turn, walking on into a wall), not an artificial freeze.

Observation text frame (`Frame.text()`), a few short lines::

    tic 120 | health 64 | reward +8.0
    Medikit: 230 units, 12 deg left
    Medikit: 410 units, ahead
    Zombieman: 520 units, 31 deg right

- `tic`: game tics since the episode started (35 tics = 1 game second).
- `health`: the player's health (0-100+).
- `reward`: the reward collected over the last `reward_window` tics (default 8).
- one line per object in the labels buffer (visible on screen this tic), nearest first, at most
  `max_objects` (default 4): the object's kind (the game's class name: Medikit, Zombieman, ShotgunGuy,
  ChaingunGuy, GreenArmor, ...), its distance in map units (a corridor is ~128 units wide, a step ~16),
  and its bearing relative to where the player looks: `ahead` within 5 degrees, else `N deg left|right`.
- `nothing in view` when no object is visible.

The scenarios come from the wheel's bundled files (`vizdoom.scenarios_path`); nothing is downloaded.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cothink.experiments.harness import optional_import

TICS_PER_SECOND = 35
AHEAD_DEG = 5.0


def _vizdoom() -> Any:
    """The optional `vizdoom` package (the ``experiments`` extra)."""
    return optional_import("vizdoom", "the ViZDoom experiment")


@dataclass(frozen=True)
class Action:
    """One entry of a scenario's action vocabulary: the word the model picks and the buttons it presses."""

    word: str  # with a leading space, as it follows "Action:" in a prompt
    buttons: tuple[str, ...]  # vizdoom Button names pressed together

    @property
    def name(self) -> str:
        return self.word.strip()


IDLE = Action(" idle", ())


@dataclass(frozen=True)
class Scenario:
    name: str
    config: str  # file name inside vizdoom.scenarios_path
    description: str  # what the model is told about the task
    actions: tuple[Action, ...]  # the vocabulary (IDLE is always available too)
    targets: tuple[str, ...]  # object kinds worth approaching
    enemies: tuple[str, ...] = ()  # object kinds worth shooting

    def action(self, name: str) -> Action:
        for a in (*self.actions, IDLE):
            if a.name == name.strip():
                return a
        raise KeyError(f"{self.name} has no action {name!r}")


SCENARIOS: dict[str, Scenario] = {
    "health_gathering": Scenario(
        name="health_gathering",
        config="health_gathering.cfg",
        description=(
            "You stand in a square room whose floor is acid: your health drops every second. "
            "Medikits lie on the floor; walking over one restores health. You score +1 for every tic "
            "you stay alive and -100 when you die. Find and walk over medikits."
        ),
        actions=(
            Action(" forward", ("MOVE_FORWARD",)),
            Action(" left", ("TURN_LEFT",)),
            Action(" right", ("TURN_RIGHT",)),
        ),
        targets=("Medikit",),
    ),
    "deadly_corridor": Scenario(
        name="deadly_corridor",
        config="deadly_corridor.cfg",
        description=(
            "You stand at the start of a corridor. At its far end lies a green armor vest; six monsters "
            "(Zombieman, ShotgunGuy, ChaingunGuy) guard the sides and shoot at you. You score for every "
            "unit you move closer to the vest, lose for moving away, and get -100 when you die. Shoot the "
            "monsters in front of you and advance to the vest."
        ),
        actions=(
            Action(" forward", ("MOVE_FORWARD",)),
            Action(" shoot", ("ATTACK",)),
            Action(" left", ("TURN_LEFT",)),
            Action(" right", ("TURN_RIGHT",)),
            Action(" back", ("MOVE_BACKWARD",)),
        ),
        targets=("GreenArmor",),
        enemies=("Zombieman", "ShotgunGuy", "ChaingunGuy"),
    ),
}


@dataclass(frozen=True)
class SeenObject:
    kind: str
    distance: float  # map units
    bearing: float  # degrees, positive = to the player's left, in (-180, 180]

    def text(self) -> str:
        if abs(self.bearing) <= AHEAD_DEG:
            where = "ahead"
        else:
            where = f"{abs(self.bearing):.0f} deg {'left' if self.bearing > 0 else 'right'}"
        return f"{self.kind}: {self.distance:.0f} units, {where}"


@dataclass(frozen=True)
class Frame:
    """What the agent is shown at one moment of the game."""

    tic: int
    health: float
    recent_reward: float
    objects: tuple[SeenObject, ...]
    finished: bool = False

    def text(self) -> str:
        head = f"tic {self.tic} | health {self.health:.0f} | reward {self.recent_reward:+.1f}"
        lines = [o.text() for o in self.objects] or ["nothing in view"]
        return "\n".join([head, *lines])

    def nearest(self, kinds: tuple[str, ...]) -> SeenObject | None:
        return next((o for o in self.objects if o.kind in kinds), None)


def bearing_deg(player_x: float, player_y: float, player_angle: float, x: float, y: float) -> float:
    """Angle from the player's view direction to (x, y), positive counter-clockwise (left)."""
    toward = math.degrees(math.atan2(y - player_y, x - player_x))
    rel = (toward - player_angle) % 360.0
    return rel - 360.0 if rel > 180.0 else rel


@dataclass
class DoomWorld:
    """One ViZDoom game, advanced explicitly. Use as a context manager (the game process is closed)."""

    scenario: Scenario
    seed: int = 0
    max_tics: int | None = None  # episode timeout; None keeps the scenario's (2100 tics)
    max_objects: int = 4
    reward_window: int = 8
    _game: Any = field(default=None, init=False, repr=False)
    _held: Action = field(default=IDLE, init=False)
    _recent: deque = field(default_factory=deque, init=False, repr=False)
    _last_frame: Frame | None = field(default=None, init=False, repr=False)
    tics: int = field(default=0, init=False)
    total_reward: float = field(default=0.0, init=False)
    actions_taken: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        vzd = _vizdoom()
        game = vzd.DoomGame()
        game.load_config(os.path.join(vzd.scenarios_path, self.scenario.config))
        game.set_window_visible(False)
        game.set_sound_enabled(False)
        game.set_mode(vzd.Mode.PLAYER)
        # the engine writes its settings file (_vizdoom.ini) next to itself: keep it out of the cwd
        self._config_dir = tempfile.mkdtemp(prefix="cothink-vizdoom-")
        game.set_doom_config_path(os.path.join(self._config_dir, "_vizdoom.ini"))
        # the smallest screen: we read labels and object positions, never pixels
        game.set_screen_resolution(vzd.ScreenResolution.RES_160X120)
        game.set_labels_buffer_enabled(True)
        game.set_objects_info_enabled(True)
        for var in ("POSITION_X", "POSITION_Y", "ANGLE"):
            game.add_available_game_variable(getattr(vzd.GameVariable, var))
        if self.max_tics is not None:
            game.set_episode_timeout(self.max_tics)
        game.set_seed(self.seed)
        self._buttons = [b.name for b in game.get_available_buttons()]
        game.init()
        self._game = game
        self.reset()

    # ---------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> DoomWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None
            shutil.rmtree(self._config_dir, ignore_errors=True)

    def reset(self) -> Frame:
        self._game.new_episode()
        self._held = IDLE
        self._recent.clear()
        self.tics = 0
        self.total_reward = 0.0
        self.actions_taken = 0
        self._last_frame = None
        return self.observe()

    # ------------------------------------------------------------------------------------- acting
    @property
    def finished(self) -> bool:
        return self._game is None or self._game.is_episode_finished()

    @property
    def held(self) -> Action:
        return self._held

    def act(self, action: Action) -> None:
        """Press `action` (replacing the held one) from the next tic on."""
        if action not in (*self.scenario.actions, IDLE):
            raise KeyError(f"{action.name!r} is not an action of {self.scenario.name}")
        self._held = action
        self.actions_taken += 1

    def advance(self, tics: int = 1) -> float:
        """Run `tics` tics with the held action; returns the reward they earned (0 once finished)."""
        reward = 0.0
        vector = [1.0 if b in self._held.buttons else 0.0 for b in self._buttons]
        for _ in range(tics):
            if self.finished:
                break
            r = float(self._game.make_action(vector, 1))
            self.tics += 1
            reward += r
            self._recent.append(r)
            while len(self._recent) > self.reward_window:
                self._recent.popleft()
        self.total_reward += reward
        return reward

    # ---------------------------------------------------------------------------------- observing
    def observe(self) -> Frame:
        """The current frame (the last frame seen, marked finished, once the episode is over)."""
        if self.finished:
            last = self._last_frame or Frame(self.tics, 0.0, 0.0, ())
            return Frame(self.tics, last.health, sum(self._recent), last.objects, finished=True)
        state = self._game.get_state()
        health, px, py, angle = (float(v) for v in state.game_variables[:4])
        seen = []
        for label in state.labels:
            if label.object_name == "DoomPlayer":
                continue
            dx, dy = label.object_position_x - px, label.object_position_y - py
            seen.append(
                SeenObject(
                    label.object_name,
                    math.hypot(dx, dy),
                    bearing_deg(px, py, angle, label.object_position_x, label.object_position_y),
                )
            )
        seen.sort(key=lambda o: o.distance)
        frame = Frame(self.tics, health, sum(self._recent), tuple(seen[: self.max_objects]))
        self._last_frame = frame
        return frame


# ------------------------------------------------------------------------------------ baselines
class RandomPolicy:
    """Uniform over the scenario's actions (not idle), seeded."""

    def __init__(self, scenario: Scenario, seed: int):
        import random

        self.scenario = scenario
        self.rng = random.Random(seed)

    def __call__(self, frame: Frame) -> Action:
        return self.rng.choice(self.scenario.actions)


class HeuristicPolicy:
    """A scripted player: shoot an enemy in the crosshair, else turn toward the nearest enemy or target,
    else go forward (health_gathering: walls turn it by chance; deadly_corridor: toward the vest)."""

    def __init__(self, scenario: Scenario, aim_deg: float = 6.0):
        self.scenario = scenario
        self.aim_deg = aim_deg

    def __call__(self, frame: Frame) -> Action:
        sc = self.scenario
        enemy = frame.nearest(sc.enemies) if sc.enemies else None
        if enemy is not None and enemy.distance < 900:
            if abs(enemy.bearing) <= self.aim_deg:
                return sc.action("shoot")
            return sc.action("left" if enemy.bearing > 0 else "right")
        target = frame.nearest(sc.targets)
        if target is not None and abs(target.bearing) > 2 * self.aim_deg:
            return sc.action("left" if target.bearing > 0 else "right")
        return sc.action("forward")


def play_baseline(
    scenario: Scenario, policy_name: str, seed: int, *, tics_per_pass: int = 1, max_tics: int | None = None
) -> DoomWorld:
    """Play one episode with a model-free policy deciding once per pass-equivalent (`tics_per_pass` tics)
    with zero latency; returns the finished (closed) world for its counters."""
    policy = RandomPolicy(scenario, seed) if policy_name == "random" else HeuristicPolicy(scenario)
    world = DoomWorld(scenario, seed=seed, max_tics=max_tics)
    try:
        while not world.finished:
            world.act(policy(world.observe()))
            world.advance(tics_per_pass)
    finally:
        world.close()
    return world
