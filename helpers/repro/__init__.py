"""The minimal repro builder: from a symptom, or a recorded hang, to a script anyone can run.

Maintainers ask for "a descriptive post with your configuration and reproducible code"; a real
training script needs its model, its data and its cluster. This module turns

- a symptom (``SYMPTOMS``: hangs at eval, at save, after early stopping, ...) into scenarios of the
  doctor's catalog (``helpers.scenarios``, one table);
- a scenario into a standalone script (``build_script``): a few dozen lines importing only torch and
  accelerate, ``Accelerator(cpu=not torch.cuda.is_available())``, its parameters baked in, and a
  comment block saying what it shows and how to launch it on N ranks (torchrun, ``accelerate launch
  --multi_gpu``, the doctor), CPU included;
- a run kept by the hang doctor (``python -m helpers doctor --keep DIR -- train.py``) into a replay
  (``build_replay``; see ``helpers.repro.replay``) that issues the recorded collectives with dummy
  tensors and fails the same way;

runs them under the doctor (``run_script``), contrasts what plain runs and the debug modes show for
a shape mismatch (``debug_contrast``) and writes an issue-ready ``report.md`` (``write_report``:
summary, environment from the audit with secrets, host names and home folders removed, the script,
the launch command, the diagnosis, versions).

CLI: ``python -m helpers repro --list`` | ``--scenario ID [--variant broken|fixed] [--num-processes N]
[--out-dir DIR] [--param NAME=VALUE ...] [--run]`` | ``--from-trace DIR --out-dir DIR2 [--run]``.
Exit 0: written (and, with ``--run``, the run behaved as expected: the broken variant diagnosed as the
catalog says, the fixed one ok, the replay as the recorded run); 1: it did not; 2: bad usage.

Modules: ``symptoms`` (symptom -> scenarios), ``script`` (scenario scripts, replays built),
``replay`` (a kept record -> a replay script), ``runs`` (under the doctor, standalone, the debug-mode
contrast), ``live`` (a job hung right now: start it under plain torchrun, attach, replay, stop; the
attach panel), ``issue`` (report.md), ``notebook`` (notebook 02's steps and panel), ``cli``.
"""

from helpers.report import Note
from helpers.repro.cli import cli_main, list_text
from helpers.repro.issue import IssueFiles, report_markdown, report_summary, write_report
from helpers.repro.live import (
    JOB_DEADLINE_S,
    AttachCheck,
    Attachments,
    HungJob,
    JobStopped,
    attach_check,
    attach_job,
    attach_panel,
    attach_to,
    job_processes,
    replay_from,
    running_jobs,
    start_hung_job,
    stop_job,
)
from helpers.repro.notebook import (
    ACTIONS,
    BUTTONS,
    ReproOutcome,
    build_for,
    check_config,
    explore,
    outcome,
    panel,
)
from helpers.repro.replay import load_recording, plan_replay, render_replay
from helpers.repro.runs import (
    RUN_TIMEOUT_S,
    DebugContrast,
    ReproRun,
    Standalone,
    debug_contrast,
    load_diagnosis,
    replay_of,
    run_fix,
    run_script,
    run_standalone,
    run_under_doctor,
)
from helpers.repro.script import (
    DEFAULT_OUT_DIR,
    ReproScript,
    build_replay,
    build_script,
    check_scenario_parameters,
    expected_text,
    launch_commands,
    render_scenario,
    scenario_expectation,
)
from helpers.repro.symptoms import (
    SYMPTOMS,
    Symptom,
    SymptomTable,
    get_scenario,
    get_symptom,
    scenario_ids,
    symptom_table,
)

__all__ = ["ACTIONS", "BUTTONS", "DEFAULT_OUT_DIR", "JOB_DEADLINE_S", "RUN_TIMEOUT_S", "SYMPTOMS",
           "AttachCheck", "Attachments", "DebugContrast", "HungJob", "IssueFiles", "JobStopped", "Note",
           "ReproOutcome", "ReproRun", "ReproScript", "Standalone", "Symptom", "SymptomTable",
           "attach_check", "attach_job", "attach_panel", "attach_to", "build_for", "build_replay",
           "build_script", "check_config", "check_scenario_parameters", "cli_main", "debug_contrast",
           "expected_text", "explore", "get_scenario", "get_symptom", "job_processes", "launch_commands",
           "list_text", "load_diagnosis", "load_recording", "outcome", "panel", "plan_replay",
           "render_replay", "render_scenario", "replay_from", "replay_of", "report_markdown",
           "report_summary", "run_fix", "run_script", "run_standalone", "run_under_doctor", "running_jobs",
           "scenario_expectation", "scenario_ids", "start_hung_job", "stop_job", "symptom_table",
           "write_report"]
