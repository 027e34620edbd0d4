"""DeepSeek-V3 (DeepSeek-AI, 2024): 61 layers 7168 wide; multi-head latent attention with 128 heads (q from a
1536-channel latent, k/v from a 512-channel one, q/k heads of 128 + 64 RoPE channels in adjacent pairs, v heads of
128); YaRN factor 40 over 4096 positions (mscale 1.0, mscale_all_dim 1.0, which scales the softmax too); the first 3
layers dense at 18432, then DeepSeek-MoE: 256 routed experts of 2048, sigmoid scores plus the e_score_correction_bias,
the top-8 from the best 4 of 8 groups (noaux_tc), renormalised and scaled by 2.5, and one shared expert. Written as
`axgen import-hf` writes transformers 5.23's DeepseekV3Config (whose defaults are these numbers) with that YaRN;
the published config.json (tests/fixtures/hf_configs/published/deepseek-v3.json, and V3.1's and R1's) imports as
this spec, its quantization_config (the Hub's FP8 blocks, which convert-hf dequantizes) the comment on
checkpoint_dtype. 671,026,404,352 parameters
as transformers counts them (correction biases are buffers, not parameters), the multi-token-prediction layer (the
Hub's model.layers.61) left out: it is not trained here."""

from axgen.spec import MLP, AdamW, Attention, Decoder, MeshRule, Model, Remat, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="deepseek-v3",
    vocab_size=129_280,
    d_model=7168,
    tie_embeddings=False,
    # The published checkpoint stores the projections as FP8 (e4m3) in 128 x 128 blocks, each with a
    # float32 weight_scale_inv (its quantization_config); convert-hf dequantizes them to checkpoint_dtype by
    # the block size in the checkpoint's config.json. Training does not keep FP8 blocks: the program trains
    # in its own dtype.
    checkpoint_dtype="bfloat16",
    decoder=Decoder(
        num_layers=61,
        attention=Attention(
            num_heads=128, num_kv_heads=128, head_dim=192, scale=0.1352337788608801
        ),  # 192**-0.5 * mscale(40, mscale_all_dim=1.0)**2
        mlp=MLP(hidden_dim=2048, activation="swiglu"),
        norm=RMSNorm(eps=1e-06),
    ),
    features=[
        F.rope(
            theta=10_000.0,
            scaling=F.rope_yarn(
                factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position=4096,
                attention_factor=1.0,
                truncate=True,
            ),
            rotary_dim=64,
            interleaved=True,
        ),
        F.mla(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            eps=1e-06,
        ),
        F.moe(
            num_experts=256,
            top_k=8,
            renormalize=True,
            scoring="sigmoid",
            routed_scale=2.5,
            shared_hidden_dim=2048,
            first_dense_layers=3,
            dense_hidden_dim=18_432,
            n_group=8,
            topk_group=4,
            group_score="top2_sum",
            # The config states no update rate for e_score_correction_bias: 0.0 holds the published bias as it
            # is (DeepSeek-V3's own rate for its last 500B tokens); 0.001 is its rate for the first 14.3T.
            balance_bias_rate=0.0,
            seq_aux_loss_weight=0.0,
            aux_loss_weight=0.0,
            router_z_loss_weight=0.0,
            # num_nextn_predict_layers=1: the multi-token-prediction layers are not trained here;
            # convert-hf leaves their tensors (the Hub's model.layers.61.*) out.
        ),
    ],
    train=Train(
        seq_len=4096,
        global_batch=1024,
        steps=1000,
        warmup_steps=10,
        optimizer=AdamW(lr=1e-05),
    ),
    targets=["tpu-v5p-1024", "gpu-h100-512", "cpu-8"],
    # 671B with Adam moments is about 10.7 TB. Fully sharded over every chip, the experts' weights gathered a layer
    # at a time would be 22.5 GB (all 256 experts, bf16) on each: the experts are split 8 ways (32 a chip) and the
    # rest of the mesh is fsdp, over which the non-expert weights are split too. One sequence per pass, full
    # remat. `axgen aot` (docs/aot.md): tpu-v5p-1024 40.61 GiB of 95.0, gpu-h100-512 52.07 GiB of 75.2;
    # gpu-h100-256 needs 82.10 with expert=8 and 99.10 with expert=16.
    mesh_rules=[
        MeshRule(
            r"(tpu-v5p|gpu-h100)-\d+",
            {"fsdp": -1, "expert": 8},
            why="671B MoE: experts split 8 ways, the rest fully sharded, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
