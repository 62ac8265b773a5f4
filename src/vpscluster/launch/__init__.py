"""Launching across the cluster: torchrun on every node, wired for WAN links, nothing left behind.

    pipeline.launch(job) -> LaunchResult     the stages: preflight, sync, prepare, start, stream,
                                             collect, teardown (pipeline.dry_run(job): build only)
    run.script_job(cluster, argv, ...)       `vpscluster run`: any torchrun-compatible script
    run.launch_script(cluster, argv, ...)    ... to the end, with recovery (a session resumes)
    supervisor.Supervisor(...).run(make_job) relaunches after failures, takes returning nodes
                                             back (rules in recovery), for train and run alike
    train.train(cfg, ...) -> report          `vpscluster train`: the built-in trainer on the local
                                             cluster or a cluster file (prepare_training, then
                                             launch_training or dry_run_training)

Pure parts: commands (per-node command lines and environment), netif (which interface carries
an address), logs (node/rank prefixes, first errors). Node-side parts run through the executor
interface: sync (content-hash copy), preflight, teardown (find and end every process by launch id).
"""
