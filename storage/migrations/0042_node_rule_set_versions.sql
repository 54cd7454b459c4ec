-- node_rule_set.rule_versions: the definition (gateway.domain.rules.rule_version) of each rule
-- a node runs, pairwise with rule_keys. The hold timer judges again, under this node's
-- definition, a pending row written under a definition no live node runs any more (a rule a
-- reload changed while its hold was pending: docs/rules-and-alarms.md, "Holds on the clock");
-- a row of a definition another live node still runs (a rolling reload) is left to that node.
-- A node of the previous release records none: its rows' definitions count as run by nobody.
ALTER TABLE node_rule_set ADD COLUMN rule_versions text[] NOT NULL DEFAULT '{}';
