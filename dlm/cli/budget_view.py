"""The terminal view of `dlm train --minutes`: the calibration and its plan as lines, the training
dashboard over the budget (one clock and percentage, the planned pace),
each re-plan as a line, and how the budget ended."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from dlm.artifacts.events import StreamEvent
from dlm.cli.dashboard import Budget, TrainingDashboard

if TYPE_CHECKING:
    from dlm.train.loop import TrainResult
    from dlm.train.plan import TrainingPlan


def plan_line(event: dict[str, Any]) -> str:
    """The plan in one line, from a calibrate stage event (which carries the plan's fields)."""

    minutes = event["budget_seconds"] / 60
    return (
        f"plan: {event['max_steps']} steps at {event['seconds_per_step']:.3g} s per step ({event['rate_source']}), "
        f"warmup {event['warmup_steps']}, validation every {event['eval_interval']}, checkpoint every "
        f"{event['save_interval']}: the cosine reaches its floor within {minutes:g} minutes"
    )


class BudgetView:
    """Renders the `budget_*` events of `dlm.train.budget.BudgetedTraining` and the training
    loop's own events (those in the dashboard) on a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.dashboard: TrainingDashboard | None = None

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.__exit__(None, None, None)
        self.dashboard = None

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def __call__(self, event: StreamEvent) -> None:
        if not isinstance(event, dict):
            if self.dashboard is not None:
                self.dashboard(event)
            return
        kind = event.get("event")
        if kind == "budget_stage":
            self._stage(event)
        elif kind == "budget_note":
            self.print(f"[yellow]note:[/] {escape(event['message'])}")
        elif kind == "budget_replan" and (
            self.dashboard is None or self.dashboard.replan(event["seconds_per_step"], event["max_steps"])
        ):
            self.print(
                f"[dim]step {event['step']}: {event['seconds_per_step']:.3g} s per step, the schedule now "
                f"ends at step {event['max_steps']} (was {event['previous_max_steps']})[/]"
            )

    def _stage(self, event: dict[str, Any]) -> None:
        stage, status = event["stage"], event["status"]
        if stage == "calibrate" and status == "running":
            self.print(f"calibrating: {escape(event['detail'])}")
        elif stage == "calibrate":
            self.print(("reused " if status == "reused" else "") + plan_line(event))
        elif status == "running":
            budget = Budget(event["budget_seconds"], event["trained_seconds"], event["seconds_per_step"])
            self.dashboard = TrainingDashboard(self.console, budget=budget).__enter__()
        elif status == "done" and self.dashboard is not None:
            self.dashboard.finish(event["outcome"])
            self.close()

    def summary(self, plan: TrainingPlan, step: int, result: TrainResult | None) -> None:
        """How the budget ended: complete, cut short by the deadline, interrupted, or already trained."""

        minutes = f"{plan.budget_seconds / 60:g} minutes"
        if result is None:
            self.print(
                f"[bold]already trained[/] to step {step} of {plan.max_steps} within {minutes}; a larger "
                "--minutes continues it"
            )
            return
        how = {"complete": f"complete within {minutes}", "paused": f"the {minutes} ran out"}
        self.print(
            f"[bold]{how.get(result.status, result.status)}[/] at step {result.step} of {plan.max_steps}; "
            f"checkpoint {escape(str(result.checkpoint))}"
        )
