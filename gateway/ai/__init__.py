"""AI summaries of alarms (docs/ai-summaries.md): the LLM port and its adapters (``llm``), the
check of a model's answer (``output``) and the worker that claims tasks and calls the model
outside every transaction (``worker``).

Entry points: ``SummaryWorker`` (built by ``gateway.runtime.components``), ``AiMetrics``.
May import ``alarms``, ``config``, ``support``, ``domain``, ``storage`` and ``protocol``; not
``outbox``, ``commands``, ``notify`` or ``maintenance`` (its own layer), nor anything above.
"""
