"""Credit against ground truth: every estimator's step credit graded on simulators that know the right answer.

    from stepcredit.diagnose import DiagnoseConfig, diagnose
    diagnosis = diagnose(DiagnoseConfig(envs=("webshop",), policy="eps=0.3"))
    diagnosis.score("webshop", "gigpo", "auc")   # Score(estimate, low, high, n, per_seed)

Behaviour policies of known skill (`policies`) play the embedded simulators;
each step is labelled by the oracle's distance to a success and by a Monte
Carlo estimate of the policy's advantage A^pi from simulator snapshots
(`sample`); every registered estimator scores the same episodes
(`estimates`); the metrics (`metrics`) grade the credit with bootstrap
intervals; `report` writes the tables and plots; `offline` grades a user's
own labelled log. `stepcredit diagnose` is the command line.
"""

from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.offline import diagnose_log
from stepcredit.diagnose.result import METRICS, Diagnosis, Example, Score
from stepcredit.diagnose.run import diagnose

__all__ = ["METRICS", "DiagnoseConfig", "Diagnosis", "Example", "Score", "diagnose",
           "diagnose_log"]
