"""What a run records and shows, apart from training code.

- :mod:`~lightning_hdet.records.history`: the logged scalars as one table (filled live or read back), pure;
- :mod:`~lightning_hdet.records.figures`: the figures drawn from it (matplotlib, optional);
- :mod:`~lightning_hdet.records.wandb`: run config, vote table, one W&B run per job;
- :mod:`~lightning_hdet.records.report`: the ``lightning-hdet-report`` command.
"""

from lightning_hdet.records.figures import log_figures_to_wandb, log_report_figures, make_figures, save_figures
from lightning_hdet.records.history import History, load_history
from lightning_hdet.records.report import write_report

__all__ = ["History", "load_history", "log_figures_to_wandb", "log_report_figures", "make_figures", "save_figures",
           "write_report"]
