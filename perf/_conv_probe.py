import torch, torch.nn.functional as F
torch.backends.cudnn.benchmark = False
def t(fn, it=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record()
    for _ in range(it): fn()
    b.record(); b.synchronize(); return a.elapsed_time(b) / it
for B, C, T, dil in ((64, 384, 4150, 9), (64, 384, 4102, 1), (64, 192, 16402, 3), (64, 96, 32822, 9), (16, 384, 1078, 9), (64, 768, 560, 9), (1, 96, 8246, 9)):
    x = torch.randn(B, C, T, device="cuda", dtype=torch.half); w = torch.randn(C, C, 7, device="cuda", dtype=torch.half) * 0.05
    ncl = t(lambda: F.conv1d(x, w, dilation=dil))
    x4 = x[:, :, None].contiguous(memory_format=torch.channels_last); w4 = w[:, :, None].contiguous(memory_format=torch.channels_last)
    y4 = F.conv2d(x4, w4, dilation=(1, dil))
    nhwc = t(lambda: F.conv2d(x4, w4, dilation=(1, dil)))
    xt = x.transpose(1, 2).contiguous()  # [B, T, C]
    print(B, C, T, dil, "ncl ms", round(ncl, 3), "nhwc ms", round(nhwc, 3), "out channels_last", y4.is_contiguous(memory_format=torch.channels_last),
          "err", float((y4[:, :, 0] - F.conv1d(x, w, dilation=dil)).abs().max()))
for B, Ci, Co, T, s in ((64, 192, 96, 16386, 2), (64, 384, 192, 4097, 4), (16, 768, 384, 129, 8)):
    x = torch.randn(B, Ci, T, device="cuda", dtype=torch.half); w = torch.randn(Ci, Co, 2 * s, device="cuda", dtype=torch.half) * 0.05
    ncl = t(lambda: F.conv_transpose1d(x, w, stride=s))
    x4 = x[:, :, None].contiguous(memory_format=torch.channels_last); w4 = w[:, :, None].contiguous(memory_format=torch.channels_last)
    nhwc = t(lambda: F.conv_transpose2d(x4, w4, stride=(1, s)))
    print("T", B, Ci, Co, T, s, "ncl ms", round(ncl, 3), "nhwc ms", round(nhwc, 3))
